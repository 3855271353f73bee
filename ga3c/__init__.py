"""GA3C mode: one model serves many environment-stepping agents through batched prediction and batched training.

Where A3G gives every worker its own model copy, GA3C (Babaeizadeh et al., "Reinforcement Learning through
Asynchronous Advantage Actor-Critic on a GPU", ICLR 2017) puts one model next to the compute device: agents only
step environments, predictors run one batched forward for every waiting observation, and trainers run one batched
update over many agents' segments. Unlike upstream GA3C this keeps the A3G model's LSTM (each env slot's state
lives with the predictor), uses GAE, keeps the terminal transition, bootstraps truncations, counts agent steps
exactly, and can correct the policy lag with truncated importance weights.

- ``buffers``: the env slots in shared memory through which agents and predictors talk (no queues, no locks).
- ``segment``: one env slot's stretch of up to ``num_steps`` transitions, the unit a trainer batches.
- ``predictor``: batched LSTM inference with per-slot state, action routing, segment assembly.
- ``batch_losses``: the A3C loss of many segments at once (optionally importance-weighted), pure math.
- ``trainer``: batched unroll and update of the shared model.
- ``agent``: the agent process loop (K environments per process).
- ``stats``: exact counters, episode records, the upstream console line and ``results.txt``.
- ``settings``: the shared hyperparameters; ``server``: predictor and trainer threads next to the model.
"""
