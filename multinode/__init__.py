"""Several machines: hogwild nodes joined through a parameter server on Ray (``main.py --ray-address``).

- ``merge``: what a node sends, what the parameter server does with it, what the node keeps (pure arithmetic),
  and the traffic and scale figures.
- ``ps``: the parameter server (global weights, step counts, the checkpoint).
- ``node``: one hogwild node (today's workers and shared model) with its sync thread.
- ``run``: the driver's side, a mode of ``main.run_training`` (``RayRun``), and ``connect``.

Nothing here is imported unless ``--ray-address`` is given.
"""
