"""The model contract: the 16 upstream keys and shapes, strict loading of upstream files, output shapes, the
batched replay equal to step-by-step forwards, and the upstream initialisation."""
from collections import OrderedDict

import pytest
import torch

from checkpoint import ModelFileError, check_state_dict, read_weights, state_dict_of
from model import A3Clstm, expected_shapes, num_parameters

KEYS = ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "conv3.weight", "conv3.bias", "conv4.weight",
        "conv4.bias", "lstm.weight_ih", "lstm.weight_hh", "lstm.bias_ih", "lstm.bias_hh", "critic_linear.weight",
        "critic_linear.bias", "actor_linear.weight", "actor_linear.bias"]


def test_state_dict_keys_shapes_and_size():
    m = A3Clstm(1, 6)
    sd = m.state_dict()
    assert list(sd.keys()) == KEYS
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected_shapes(6, 512)
    assert sd["lstm.weight_ih"].shape == (2048, 1024) and sd["actor_linear.weight"].shape == (6, 512)
    assert num_parameters(m) == 3_249_639


def test_hidden_size_flag_changes_shapes():
    sd = A3Clstm(1, 4, hidden_size=256).state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected_shapes(4, 256)


def test_a_file_of_another_hidden_size_names_the_flag_that_loads_it(tmp_path):
    """The error names the file's hidden size, read from its LSTM (before: "check --hidden-size, now 64")."""
    from checkpoint import ModelFileError, check_state_dict
    with pytest.raises(ModelFileError) as e:
        check_state_dict(A3Clstm(1, 6, 32).state_dict(), 6, 64, tmp_path / "m.dat", "PongNoFrameskip-v4")
    assert str(e.value).endswith("(the file's hidden size is 32: pass --hidden-size 32, now 64)")


@pytest.mark.parametrize("batch", [1, 8])
def test_output_shapes(batch):
    m = A3Clstm(1, 6)
    hx, cx = m.initial_state(batch)
    value, logits, (hx2, cx2) = m(torch.randn(batch, 1, 80, 80), (hx, cx))
    assert value.shape == (batch, 1) and logits.shape == (batch, 6)
    assert hx2.shape == cx2.shape == (batch, 512)


def test_batch_rows_are_independent():
    m = A3Clstm(1, 6, 64)
    x = torch.randn(8, 1, 80, 80)
    state = (torch.randn(8, 64), torch.randn(8, 64))
    v8, l8, _ = m(x, state)
    v1, l1, _ = m(x[3:4], (state[0][3:4], state[1][3:4]))
    assert torch.allclose(v8[3], v1[0], atol=1e-5) and torch.allclose(l8[3], l1[0], atol=1e-5)


def test_unroll_equals_stepwise_forward_and_channels_last_is_the_same_function():
    torch.manual_seed(0)
    m = A3Clstm(1, 6, 64)
    fast = A3Clstm(1, 6, 64).channels_last()
    fast.load_state_dict(m.state_dict())
    frames = torch.randn(5, 1, 80, 80)
    state = (torch.randn(1, 64), torch.randn(1, 64))
    values, logits = [], []
    hx, cx = state
    for t in range(5):
        v, lg, (hx, cx) = m(frames[t:t + 1], (hx, cx))
        values.append(v.view(1))
        logits.append(lg)
    for model in (m, fast):
        uv, ul = model.unroll(frames, state)
        assert torch.allclose(uv, torch.cat(values), atol=1e-5)
        assert torch.allclose(ul, torch.cat(logits), atol=1e-5)


def test_upstream_initialisation():
    torch.manual_seed(0)
    m = A3Clstm(1, 6)
    h = 512
    assert torch.allclose(m.actor_linear.weight.norm(dim=1), torch.full((6,), 0.01), atol=1e-6)
    assert torch.allclose(m.critic_linear.weight.norm(dim=1), torch.ones(1), atol=1e-6)
    assert m.actor_linear.bias.abs().sum() == 0 and m.critic_linear.bias.abs().sum() == 0
    assert torch.all(m.lstm.bias_ih[h:2 * h] == 1) and m.lstm.bias_ih[:h].abs().sum() == 0
    assert m.lstm.bias_ih[2 * h:].abs().sum() == 0 and m.lstm.bias_hh.abs().sum() == 0
    w = m.lstm.weight_hh  # orthogonal: W^T W = I (W is 4H x H)
    assert torch.allclose(w.T @ w, torch.eye(h), atol=1e-4)
    for conv in (m.conv1, m.conv2, m.conv3, m.conv4):
        assert conv.bias.abs().sum() == 0
        fan_in = conv.weight[0].numel()
        bound = (2 ** 0.5) / fan_in ** 0.5  # kaiming_uniform(a=sqrt(5)) bound is 1/sqrt(fan_in), times relu gain
        # uniform on [-bound, bound]: of 800 or more weights the largest is above 0.9 bound (without the gain the
        # bound is bound / sqrt(2), about 0.71 bound)
        assert 0.9 * bound < conv.weight.abs().max() <= bound + 1e-6


def upstream_file(tmp_path, legacy: bool, actions=6, hidden=512):
    """A model file as upstream wrote it: a bare OrderedDict of tensors (legacy non-zip format for 2017 files)."""
    g = torch.Generator().manual_seed(3)
    sd = OrderedDict((k, torch.randn(s, generator=g)) for k, s in expected_shapes(actions, hidden).items())
    path = tmp_path / ("legacy.dat" if legacy else "new.dat")
    torch.save(sd, path, _use_new_zipfile_serialization=not legacy)
    return path, sd


@pytest.mark.parametrize("legacy", [False, True])
def test_upstream_file_loads_strictly(tmp_path, legacy):
    path, sd = upstream_file(tmp_path, legacy)
    loaded = state_dict_of(read_weights(path), path)
    check_state_dict(loaded, 6, 512, path, "PongNoFrameskip-v4")
    m = A3Clstm(1, 6)
    m.load_state_dict(loaded, strict=True)
    for k, v in m.state_dict().items():
        assert torch.equal(v, sd[k])


def test_a_float16_file_loads_into_the_float32_model_with_upstreams_code(tmp_path):
    """A model stored in half the bytes: upstream's ``torch.load`` + ``load_state_dict`` (and ours) copy the
    float16 values into the float32 weights exactly; the model stays float32."""
    path, sd = upstream_file(tmp_path, False)
    half = OrderedDict((k, v.half()) for k, v in sd.items())
    torch.save(half, path)
    m = A3Clstm(1, 6)
    m.load_state_dict(torch.load(path, map_location=lambda storage, loc: storage), strict=True)  # upstream's
    loaded = state_dict_of(read_weights(path), path)
    check_state_dict(loaded, 6, 512, path, "PongNoFrameskip-v4")
    ours = A3Clstm(1, 6)
    ours.load_state_dict(loaded, strict=True)
    for k, v in m.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, half[k].float()) and torch.equal(ours.state_dict()[k], v)


def test_a_file_of_integer_tensors_is_refused(tmp_path):
    path, sd = upstream_file(tmp_path, False)
    sd["conv1.weight"] = sd["conv1.weight"].to(torch.int64)
    torch.save(sd, path)
    with pytest.raises(ModelFileError, match=r"holds torch.int64 tensors \(conv1.weight\), not floating-point"):
        check_state_dict(state_dict_of(read_weights(path), path), 6, 512, path, "PongNoFrameskip-v4")


def test_mismatched_file_names_key_and_shapes(tmp_path):
    path, _ = upstream_file(tmp_path, False, actions=4)
    sd = state_dict_of(read_weights(path), path)
    with pytest.raises(ModelFileError, match=r"actor_linear.weight has shape \(4, 512\).*needs \(6, 512\)"):
        check_state_dict(sd, 6, 512, path, "PongNoFrameskip-v4")


def test_corrupt_and_foreign_files(tmp_path):
    bad = tmp_path / "bad.dat"
    bad.write_bytes(b"this is not a model")
    with pytest.raises(ModelFileError, match="corrupt or not a PyTorch weights file"):
        read_weights(bad)
    # a text file: torch.load's legacy reader raises KeyError(the first byte), which said "(116)" to the user
    with pytest.raises(ModelFileError) as e:
        read_weights(bad)
    assert "(its bytes are neither a zip archive nor a pickle that torch.load reads)" in str(e.value)
    listed = tmp_path / "listed.dat"
    torch.save([torch.zeros(1)], listed)
    with pytest.raises(ModelFileError, match="holds a list, not a state_dict: point to a .dat or .ckpt that main.py "
                                             "wrote, or an upstream .dat"):
        read_weights(listed)
    other = tmp_path / "other.dat"
    torch.save({"a": torch.zeros(1)}, other)
    with pytest.raises(ModelFileError, match="missing conv1.weight"):
        check_state_dict(state_dict_of(read_weights(other), other), 6, 512, other, "Pong")
    pickled = tmp_path / "pickled.dat"
    torch.save(A3Clstm(1, 6, 8), pickled)  # a whole pickled module is not a weights file
    with pytest.raises(ModelFileError):
        read_weights(pickled)


def test_replay_from_saved_activations_gives_the_same_gradients():
    from model import ActivationCache
    torch.manual_seed(0)
    m = A3Clstm(1, 6, 64).channels_last()
    frames = torch.randn(6, 1, 80, 80)
    frames[:, :, :20] = 0.0  # a flat region: ties inside max-pool windows
    state = (torch.randn(1, 64), torch.randn(1, 64))
    cache = ActivationCache()
    with torch.no_grad():
        hx, cx = state
        for t in range(6):
            _, _, (hx, cx) = m(frames[t:t + 1], (hx, cx), cache)
    assert len(cache) == 6
    results = []
    for c in (None, cache):
        m.zero_grad(set_to_none=True)
        values, logits = m.unroll(frames, state, c)
        (values.pow(2).sum() + logits.logsumexp(1).sum()).backward()
        results.append((values.detach(), [p.grad.clone() for p in m.parameters()]))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-6)
    for (name, _), a, b in zip(m.named_parameters(), results[0][1], results[1][1]):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4), name


@pytest.mark.parametrize("steps", [1, 7])
def test_lstm_replay_backward_equals_autograd_through_lstmcell_steps(steps):
    from model import ActivationCache, _LSTMReplay
    torch.manual_seed(steps)
    m = A3Clstm(1, 6, 16).double()
    feats = torch.randn(steps, 1024, dtype=torch.float64)
    state = (torch.randn(1, 16, dtype=torch.float64), torch.randn(1, 16, dtype=torch.float64))
    upstream = torch.randn(steps, 16, dtype=torch.float64)  # an arbitrary gradient on the hidden states
    lstm = m.lstm
    cache = ActivationCache()
    with torch.no_grad():
        hx, cx = state
        for t in range(steps):
            hx, cx = m._lstm_step(feats[t: t + 1], (hx, cx), cache)
    x1 = feats.clone().requires_grad_()
    hs = _LSTMReplay.apply(x1, cache.stacked_lstm(), state, lstm.weight_ih, lstm.weight_hh, lstm.bias_ih,
                           lstm.bias_hh)
    (hs * upstream).sum().backward()
    replay = [x1.grad] + [p.grad.clone() for p in lstm.parameters()]
    m.zero_grad(set_to_none=True)
    x2 = feats.clone().requires_grad_()
    hx, cx = state
    reference_h = []
    for t in range(steps):
        hx, cx = lstm(x2[t: t + 1], (hx, cx))
        reference_h.append(hx)
    reference_h = torch.cat(reference_h)
    (reference_h * upstream).sum().backward()
    reference = [x2.grad] + [p.grad for p in lstm.parameters()]
    assert torch.allclose(hs, reference_h, atol=1e-12)
    for (name, _), a, b in zip([("input", None)] + list(lstm.named_parameters()), replay, reference):
        assert torch.allclose(a, b, atol=1e-10, rtol=1e-8), name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("batch", [3, 9])
def test_the_first_block_in_pieces_is_the_same_function_as_in_one_piece(monkeypatch, precision, batch):
    """``features`` runs the first conv block a few frames at a time on a CPU: the same features, saved
    activations and gradients as one piece (a batch the piece size does not divide, and one it does not reach)."""
    import model
    from model import ActivationCache
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    torch.manual_seed(0)
    m = A3Clstm(1, 6, 64).channels_last().set_precision(dtype)
    frames = torch.rand(batch, 1, 80, 80)
    frames[:, :, :20] = 0.0  # ties inside max-pool windows
    assert model.FIRST_BLOCK_CHUNK == 4
    results = []
    for chunk in (model.FIRST_BLOCK_CHUNK, 10 ** 9):
        monkeypatch.setattr(model, "FIRST_BLOCK_CHUNK", chunk)
        cache = ActivationCache()
        with torch.no_grad():
            acted = m.features(frames, cache)
        m.zero_grad(set_to_none=True)
        feats = m.features(frames)
        (feats * torch.linspace(-1, 1, feats.shape[1])).square().sum().backward()
        results.append((acted, cache.stacked(), feats.detach(), {n: p.grad.clone() for n, p in m.named_parameters()
                                                                  if n.startswith("conv")}))
    (acted, blocks, feats, grads), (acted1, blocks1, feats1, grads1) = results
    assert torch.equal(acted, acted1) and torch.equal(feats, feats1) and torch.equal(acted, feats)
    assert len(blocks) == len(blocks1) == 4
    for block, block1 in zip(blocks, blocks1):
        for a, b in zip(block, block1):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert blocks[0][1].shape == (batch, 32, 40, 40) and blocks[0][2].dtype == dtype
    assert blocks[1][0].is_contiguous(memory_format=torch.channels_last)
    # the pieces' weight gradients are summed in float32; in bf16 each piece's is rounded to bf16 first
    rtol = 1e-5 if precision == "fp32" else 2e-2
    assert set(grads) == set(grads1) == {f"conv{k}.{p}" for k in range(1, 5) for p in ("weight", "bias")}
    for name in grads:
        assert grads[name].dtype == torch.float32 and grads[name].abs().sum() > 0, name
        torch.testing.assert_close(grads[name], grads1[name], rtol=rtol, atol=rtol * grads1[name].abs().max(),
                                   msg=lambda m, name=name: f"{name}: {m}")


def _acted_cache(m, frames, state):
    """An ``ActivationCache`` filled by acting on ``frames`` one at a time, as a worker does."""
    from model import ActivationCache
    cache = ActivationCache()
    with torch.no_grad():
        hx, cx = state
        for t in range(frames.shape[0]):
            _, _, (hx, cx) = m(frames[t:t + 1], (hx, cx), cache)
    return cache


def test_stacked_activations_hold_each_block_output_once():
    """``ActivationCache.stacked`` gives block k+1 block k's concatenated output as its input (one copy, not
    two), with the values of concatenating every field; a cache whose inputs are other tensors is copied."""
    from model import ActivationCache
    torch.manual_seed(0)
    m = A3Clstm(1, 6, 64).channels_last()
    cache = _acted_cache(m, torch.rand(5, 1, 80, 80), m.initial_state())
    blocks = cache.stacked()
    assert len(blocks) == 4
    for b, block in enumerate(blocks):
        for i, t in enumerate(block):
            assert torch.equal(t, torch.cat([step[b][i] for step in cache.steps])), (b, i)
        assert block[0].shape[0] == 5
        if b:
            assert block[0].data_ptr() == blocks[b - 1][2].data_ptr(), b
    other = ActivationCache()
    for step in cache.steps:
        for block_input, indices, output in step:
            other.add(block_input.clone(), indices, output)
    copied = other.stacked()
    for b in range(1, 4):
        assert copied[b][0].data_ptr() != copied[b - 1][2].data_ptr()
        assert torch.equal(copied[b][0], blocks[b][0])


def test_replay_frees_the_saved_activations_after_backward(monkeypatch):
    """The replayed activations go when the backward is done, while the loss that used them is still alive (a
    worker keeps its last loss through the next rollout)."""
    import weakref

    from model import ActivationCache
    torch.manual_seed(0)
    m = A3Clstm(1, 6, 64).channels_last()
    frames = torch.rand(4, 1, 80, 80)
    cache = _acted_cache(m, frames, m.initial_state())
    refs = []
    stacked = ActivationCache.stacked

    def watched(self):
        blocks = stacked(self)
        refs.extend(weakref.ref(t) for block in blocks for t in block)
        return blocks

    monkeypatch.setattr(ActivationCache, "stacked", watched)
    values, logits = m.unroll(frames, m.initial_state(), cache)
    loss = values.pow(2).sum() + logits.logsumexp(1).sum()
    del values, logits, cache
    assert len(refs) == 12 and all(r() is not None for r in refs)
    loss.backward()
    assert m.conv1.weight.grad.abs().sum() > 0
    assert [r() for r in refs] == [None] * 12


@pytest.mark.parametrize("batch", [9, 3])
def test_autograd_keeps_one_copy_of_the_first_block_output(batch):
    """Under autograd the first block, run in pieces, leaves its output (32 x 40 x 40 a frame) saved once for
    the backward: the ReLU's result and conv2's input are one tensor, not the pieces' and their concatenation."""
    import model
    torch.manual_seed(0)
    m = A3Clstm(1, 6, 64).channels_last()
    assert batch > model.FIRST_BLOCK_CHUNK or batch < model.FIRST_BLOCK_CHUNK
    saved = {}

    def pack(t):
        if t.is_floating_point() and tuple(t.shape[1:]) == (32, 40, 40):
            saved[t.untyped_storage().data_ptr()] = t.shape[0]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        feats = m.features(torch.rand(batch, 1, 80, 80))
    assert saved and sum(saved.values()) == batch, saved
    feats.sum().backward()
    assert m.conv1.weight.grad.abs().sum() > 0
