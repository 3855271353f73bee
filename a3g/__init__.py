"""A3G mode (``--mode a3g``): ``--workers`` hogwild training processes and the monitor.

- ``run``: the mode as ``main.py`` drives it (``A3gRun``), the start of its processes (``launch``), the bounded
  stop of a run's processes (``shutdown``, which every mode's run uses) and the status line.

The processes themselves are the top-level ``train.py`` (a worker) and ``test.py`` (the monitor), which the other
modes reuse: GA3C's monitor is ``test.test``, and a Ray node starts its workers with ``launch``.
"""
