"""The A3C-LSTM actor-critic of the A3G line (``A3Clstm``), with the upstream state_dict and initialisation.

Input: a batch of preprocessed frames ``(B, 1, 80, 80)`` float32 and the LSTM state ``(hx, cx)``, each ``(B, H)``.
Each conv block is conv -> max_pool2d(2, 2) -> ReLU; 80 -> 40 -> 19 -> 9 -> 4, flattened to 1024 features.
Output: ``value (B, 1)``, ``logits (B, A)`` and the new ``(hx, cx)``.

The state_dict has exactly the 16 upstream keys (conv1..4 weight/bias, lstm.weight_ih/weight_hh/bias_ih/bias_hh,
critic_linear.weight/bias, actor_linear.weight/bias), so ``.dat`` files from upstream load strictly.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

FEATURES = 1024


def norm_col_init(weights: torch.Tensor, std: float = 1.0) -> torch.Tensor:
    """Draw N(0, 1) and rescale each output row to L2 norm ``std`` (upstream actor/critic init)."""
    x = torch.randn(weights.size())
    x *= std / torch.sqrt((x ** 2).sum(1, keepdim=True))
    return x


class A3Clstm(nn.Module):
    """Conv encoder + LSTMCell + linear actor and critic heads (see module docstring)."""

    def __init__(self, num_inputs: int, num_actions: int, hidden_size: int = 512):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_actions = num_actions
        self.conv1 = nn.Conv2d(num_inputs, 32, 5, stride=1, padding=2)
        self.conv2 = nn.Conv2d(32, 32, 5, stride=1, padding=1)
        self.conv3 = nn.Conv2d(32, 64, 4, stride=1, padding=1)
        self.conv4 = nn.Conv2d(64, 64, 3, stride=1, padding=1)
        self.lstm = nn.LSTMCell(FEATURES, hidden_size)
        self.critic_linear = nn.Linear(hidden_size, 1)
        self.actor_linear = nn.Linear(hidden_size, num_actions)
        self.compute_dtype = torch.float32  # the conv encoder's; see set_precision
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Upstream initialisation: conv weights PyTorch default times the ReLU gain, conv biases 0; LSTM
        weight_ih xavier-uniform, weight_hh orthogonal, biases 0 but the forget-gate slice of bias_ih = 1;
        actor rows at norm 0.01, critic rows at norm 1.0, head biases 0."""
        gain = nn.init.calculate_gain("relu")
        for conv in (self.conv1, self.conv2, self.conv3, self.conv4):
            conv.reset_parameters()
            conv.weight.mul_(gain)
            conv.bias.zero_()
        h = self.hidden_size
        nn.init.xavier_uniform_(self.lstm.weight_ih)
        nn.init.orthogonal_(self.lstm.weight_hh)
        self.lstm.bias_ih.zero_()
        self.lstm.bias_hh.zero_()
        self.lstm.bias_ih[h: 2 * h] = 1.0
        self.actor_linear.weight.copy_(norm_col_init(self.actor_linear.weight, 0.01))
        self.actor_linear.bias.zero_()
        self.critic_linear.weight.copy_(norm_col_init(self.critic_linear.weight, 1.0))
        self.critic_linear.bias.zero_()

    def channels_last(self) -> "A3Clstm":
        """Store the conv weights channels-last (NHWC), about 1.5-2x faster forward and backward on CPU; the
        state_dict keys, shapes and values are unchanged."""
        return self.to(memory_format=torch.channels_last)

    def set_precision(self, dtype: torch.dtype) -> "A3Clstm":
        """Run the conv encoder in ``dtype`` (``torch.bfloat16`` or ``torch.float32``, see ``precision``).

        The weights stay float32: each conv casts its weight and bias to ``dtype`` as it runs (a differentiable
        cast, so gradients reach the float32 weights as float32), and ``features`` returns float32. The LSTM, its
        state and the heads always run in float32. A plain attribute: the state_dict does not change."""
        self.compute_dtype = dtype
        return self

    def convs(self) -> tuple[nn.Conv2d, ...]:
        return self.conv1, self.conv2, self.conv3, self.conv4

    def _conv(self, conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == conv.weight.dtype:
            return conv(x)
        return F.conv2d(x, conv.weight.to(x.dtype), conv.bias.to(x.dtype), conv.stride, conv.padding)

    def features(self, x: torch.Tensor, cache: "ActivationCache | None" = None) -> torch.Tensor:
        """Conv encoder: ``(B, 1, 80, 80) -> (B, 1024)``.

        With ``cache`` (acting under ``no_grad``), each block's input, max-pool indices and output are appended
        to it, so that a later update can compute the conv weight gradients without running the convolutions
        forward again (see ``unroll``). The blocks run in ``compute_dtype`` (their saved activations too); the
        features returned are float32. On a CPU the first block's convolution and max-pool run
        ``FIRST_BLOCK_CHUNK`` frames at a time, so that the convolution's output (32 x 80 x 80 values a frame) and,
        under autograd, its gradient stay in the CPU's caches while they are used; the pooled pieces are
        concatenated and go through one ReLU (max-pool and ReLU commute), so that autograd keeps one copy of the
        block's output. The values are the same as in one piece; the conv1 weight gradient is the sum of the
        pieces'. Autograd still keeps each piece's pre-pool output for the max-pool backward.
        """
        x = x.to(self.compute_dtype)
        if self.conv2.weight.is_contiguous(memory_format=torch.channels_last):
            x = x.contiguous(memory_format=torch.channels_last)
        chunk = FIRST_BLOCK_CHUNK if x.device.type == "cpu" else x.shape[0]
        for k, conv in enumerate(self.convs()):
            parts = x.split(chunk) if k == 0 and len(x) > chunk else (x,)
            pieces = [self._conv_pool(conv, p, cache is not None) for p in parts]
            out = F.relu(pieces[0][0] if len(pieces) == 1 else torch.cat([p[0] for p in pieces]))
            if cache is not None:
                cache.add(x, pieces[0][1] if len(pieces) == 1 else torch.cat([p[1] for p in pieces]), out)
            x = out
        return x.flatten(1).float()

    def _conv_pool(self, conv: nn.Conv2d, x: torch.Tensor, with_indices: bool):
        """A conv block before its ReLU, conv -> max-pool 2x2: ``(pooled, max-pool indices or None)``."""
        if not with_indices:
            return F.max_pool2d(self._conv(conv, x), 2, 2), None
        return F.max_pool2d(self._conv(conv, x), 2, 2, return_indices=True)

    def heads(self, hx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``hx (B, H) -> value (B, 1), logits (B, A)``."""
        return self.critic_linear(hx), self.actor_linear(hx)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor],
                cache: "ActivationCache | None" = None):
        """One step for a batch: ``x (B, 1, 80, 80)``, ``state = (hx, cx)`` each ``(B, H)``.

        With ``cache`` (acting under ``no_grad``), the conv blocks' and the LSTM's activations are saved in it.
        """
        feats = self.features(x, cache)
        if cache is None:
            hx, cx = self.lstm(feats, state)
        else:
            hx, cx = self._lstm_step(feats, state, cache)
        value, logits = self.heads(hx)
        return value, logits, (hx, cx)

    def _lstm_step(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], cache: "ActivationCache"):
        """The LSTMCell step written out as ATen's CPU ``lstm_cell`` does it, keeping its activated gates
        ``[i, f, g, o]`` and the new state for the update's backward (``_LSTMReplay``)."""
        hx, cx = state
        lstm = self.lstm
        gates = F.linear(hx, lstm.weight_hh, lstm.bias_hh).add_(F.linear(x, lstm.weight_ih, lstm.bias_ih))
        i, f, g, o = gates.chunk(4, 1)
        i.sigmoid_()
        f.sigmoid_()
        g.tanh_()
        o.sigmoid_()
        cy = (f * cx).add_(i * g)
        hy = o * cy.tanh()
        cache.add_lstm(gates, cy, hy)
        return hy, cy

    def unroll(self, frames: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor],
               cache: "ActivationCache | None" = None):
        """Replay a rollout of one agent: ``frames (T, 1, 80, 80)`` from LSTM ``state`` (each ``(1, H)``).

        With the ``cache`` filled while acting with these same weights, nothing runs forward again: the conv
        features and the LSTM outputs are taken from it, and backward computes the gradients from the saved
        activations (``_Replay`` for the conv blocks, ``_LSTMReplay`` for the LSTM; only the heads run).
        Without ``cache`` the convolutions run batched over the T frames (much cheaper than T batch-1 calls)
        and the LSTM runs as one sequence op (``torch.lstm``, the kernel behind ``nn.LSTM``) with this cell's
        own weights. Either way this returns ``values (T,)``, ``logits (T, A)``, equal to T calls of
        ``forward``, gradients included (tested).
        """
        lstm = self.lstm
        if cache is None:
            feats = self.features(frames)
            hx, cx = state
            out, _, _ = torch.lstm(feats.unsqueeze(1), (hx.unsqueeze(0), cx.unsqueeze(0)),
                                   [lstm.weight_ih, lstm.weight_hh, lstm.bias_ih, lstm.bias_hh],
                                   True, 1, 0.0, self.training, False, False)
            hs = out.squeeze(1)
        else:
            convs = self.convs()
            feats = _Replay.apply(cache.stacked(), convs, *[p for c in convs for p in (c.weight, c.bias)])
            hs = _LSTMReplay.apply(feats, cache.stacked_lstm(), state, lstm.weight_ih, lstm.weight_hh,
                                   lstm.bias_ih, lstm.bias_hh)
        value, logits = self.heads(hs)
        return value.squeeze(1), logits

    def initial_state(self, batch: int = 1, device: torch.device | str = "cpu"):
        """Zero LSTM state ``(hx, cx)`` of shape ``(batch, H)``."""
        z = torch.zeros(batch, self.hidden_size, device=device)
        return z, z.clone()


class ActivationCache:
    """What the model computed while acting, per step: each conv block's input, max-pool indices and output,
    and the LSTM's activated gates and new cell and hidden state."""

    def __init__(self):
        self.steps: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
        self._current: list | None = None
        self.lstm_steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def add_lstm(self, gates: torch.Tensor, cy: torch.Tensor, hy: torch.Tensor) -> None:
        self.lstm_steps.append((gates, cy, hy))

    def stacked_lstm(self) -> tuple[torch.Tensor, ...]:
        """``(gates (T, 4H), c (T, H), h (T, H))``: the T steps concatenated (the LSTM's inputs are the conv
        features, which the conv replay gives)."""
        return tuple(torch.cat([step[i] for step in self.lstm_steps]) for i in range(3))

    def add(self, block_input: torch.Tensor, indices: torch.Tensor, output: torch.Tensor) -> None:
        if self._current is None or len(self._current) == 4:
            self._current = []
            self.steps.append(self._current)
        self._current.append((block_input, indices, output))

    def __len__(self) -> int:
        return len(self.steps)

    def stacked(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per block, the T steps concatenated along the batch dimension. A block whose input was, at every step,
        the previous block's output (as ``A3Clstm.features`` saves them) gets that block's concatenated output
        as its input: one copy, not two."""
        blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for b in range(4):
            if b and all(step[b][0] is step[b - 1][2] for step in self.steps):
                block_input = blocks[-1][2]
            else:
                block_input = torch.cat([step[b][0] for step in self.steps])
            blocks.append((block_input, *(torch.cat([step[b][i] for step in self.steps]) for i in (1, 2))))
        return blocks


class _LSTMReplay(torch.autograd.Function):
    """The LSTM's outputs over a rollout as a function of its input features and weights, from the gates saved
    while acting: forward returns the saved hidden states ``h (T, H)``; backward is the LSTMCell backward
    through time done by hand, the weight and input gradients one matrix product each over the T steps.
    The gradients equal autograd's through T ``LSTMCell`` steps (tested). The initial state gets none: it is
    carried over from the last rollout, detached."""

    @staticmethod
    def forward(ctx, feats, saved, state, w_ih, w_hh, b_ih, b_hh):
        gates, c, h = saved
        h0, c0 = state
        ctx.save_for_backward(feats, gates, c, h, h0, c0, w_ih, w_hh)
        return h

    @staticmethod
    def backward(ctx, dh_out):
        feats, gates, c, h, h0, c0, w_ih, w_hh = ctx.saved_tensors
        steps, n = c.shape
        i, f, g, o = gates.split(n, 1)
        c_prev = torch.cat([c0, c[:-1]])
        tanh_c = c.tanh()
        # d(c_t) from d(h_t): o * (1 - tanh^2 c); d(pre-activation o) from d(h_t): tanh c * o(1 - o)
        from_h_to_c = o * (1 - tanh_c * tanh_c)
        o_pre = tanh_c * o * (1 - o)
        # d(pre-activation) of i, f, g from d(c_t): g * i(1-i), c_prev * f(1-f), i * (1 - g^2)
        ifg_pre = torch.stack([g * i * (1 - i), c_prev * f * (1 - f), i * (1 - g * g)], 1)  # (T, 3, H)
        d_gates = torch.empty_like(gates)
        d_ifg = d_gates[:, : 3 * n].view(steps, 3, n)
        d_o = d_gates[:, 3 * n:]
        dh_next = torch.zeros_like(h0)
        dc_next = torch.zeros_like(c0)
        for t in range(steps - 1, -1, -1):
            dh = dh_out[t: t + 1] + dh_next
            dc = torch.addcmul(dc_next, dh, from_h_to_c[t: t + 1])
            torch.mul(ifg_pre[t], dc, out=d_ifg[t])
            torch.mul(o_pre[t: t + 1], dh, out=d_o[t: t + 1])
            if t:
                dh_next = d_gates[t: t + 1] @ w_hh
                dc_next = dc * f[t: t + 1]
        h_prev = torch.cat([h0, h[:-1]])
        d_bias = d_gates.sum(0)
        d_feats = d_gates @ w_ih if ctx.needs_input_grad[0] else None
        return d_feats, None, None, d_gates.t() @ feats, d_gates.t() @ h_prev, d_bias, d_bias.clone()


class _Replay(torch.autograd.Function):
    """The conv encoder's output as a function of its weights, from activations saved while acting.

    forward returns the saved features (as float32); backward is autograd's own conv-block backward (ReLU,
    max-pool with the saved indices, convolution) done by hand over the batch of saved activations, in their
    dtype: bfloat16 activations (``--precision bf16``) give a bfloat16 backward against the weights cast to
    bfloat16, as a second forward in bf16 would. The weight and bias gradients are returned as float32, the
    first block's pieces summed in float32. The gradients are those of running the encoder again on the same
    activations, equal up to float rounding (tested), without the second forward pass. The activations are held
    through ``save_for_backward``, so autograd frees them after the backward, as it frees its own.
    """

    @staticmethod
    def forward(ctx, blocks, convs, *params):
        ctx.save_for_backward(*(t for block in blocks for t in block))
        ctx.convs = convs
        return blocks[-1][2].flatten(1).float()

    @staticmethod
    def backward(ctx, grad):
        saved, convs = ctx.saved_tensors, ctx.convs
        blocks = [saved[3 * k: 3 * k + 3] for k in range(len(saved) // 3)]
        grads: list[torch.Tensor | None] = [None] * (2 * len(convs))
        g = grad.reshape(blocks[-1][2].shape).to(blocks[-1][2].dtype)
        for k in range(len(convs) - 1, -1, -1):
            g = torch.ops.aten.threshold_backward(g, blocks[k][2], 0)
            if k:
                g, gw, gb = _block_backward(g, convs[k], blocks[k], True)
                grads[2 * k], grads[2 * k + 1] = gw.float(), gb.float()
            else:  # its gradient has 32 x 80 x 80 floats per frame: on a CPU, a few frames at a time stay in cache
                chunk = FIRST_BLOCK_CHUNK if g.device.type == "cpu" else g.shape[0]
                parts = [_block_backward(g[i: i + chunk], convs[0], [t[i: i + chunk] for t in blocks[0]], False)
                         for i in range(0, g.shape[0], chunk)]
                grads[0] = torch.stack([p[1].float() for p in parts]).sum(0)
                grads[1] = torch.stack([p[2].float() for p in parts]).sum(0)
        return (None, None, *grads)


FIRST_BLOCK_CHUNK = 4  # frames per piece of the first conv block, forward and backward (budget.py measures it)


def _block_backward(g: torch.Tensor, conv: nn.Conv2d, block, input_grad: bool):
    """A conv block's backward from the gradient of its max-pool output (after the ReLU's): max-pool backward
    with the saved indices, then the convolution's, in the dtype of the saved activations. Returns ``(input grad
    or None, weight grad, bias grad)`` in that dtype."""
    block_input, indices, _ = block
    weight = conv.weight if conv.weight.dtype == block_input.dtype else conv.weight.detach().to(block_input.dtype)
    pre_pool = (indices.shape[0], conv.out_channels,
                block_input.shape[2] + 2 * conv.padding[0] - conv.kernel_size[0] + 1,
                block_input.shape[3] + 2 * conv.padding[1] - conv.kernel_size[1] + 1)
    like = torch.empty(pre_pool, device=g.device, dtype=g.dtype,
                       memory_format=torch.channels_last if indices.is_contiguous(
                           memory_format=torch.channels_last) else torch.contiguous_format)
    g = torch.ops.aten.max_pool2d_with_indices_backward(g, like, [2, 2], [2, 2], [0, 0], [1, 1], False, indices)
    return torch.ops.aten.convolution_backward(
        g, block_input, weight, [conv.out_channels], list(conv.stride), list(conv.padding),
        list(conv.dilation), False, [0, 0], 1, [input_grad, True, True])


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def expected_shapes(num_actions: int, hidden_size: int = 512, num_inputs: int = 1) -> dict[str, tuple]:
    """The 16 state_dict keys and shapes a model file must have (for clear load errors)."""
    h = hidden_size
    return {
        "conv1.weight": (32, num_inputs, 5, 5), "conv1.bias": (32,),
        "conv2.weight": (32, 32, 5, 5), "conv2.bias": (32,),
        "conv3.weight": (64, 32, 4, 4), "conv3.bias": (64,),
        "conv4.weight": (64, 64, 3, 3), "conv4.bias": (64,),
        "lstm.weight_ih": (4 * h, FEATURES), "lstm.weight_hh": (4 * h, h),
        "lstm.bias_ih": (4 * h,), "lstm.bias_hh": (4 * h,),
        "critic_linear.weight": (1, h), "critic_linear.bias": (1,),
        "actor_linear.weight": (num_actions, h), "actor_linear.bias": (num_actions,),
    }

