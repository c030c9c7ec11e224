"""The plan: a run's RL step compiled for a TPU slice or GPU cluster that is not attached, and
what the target's own compiler says of it. `python -m grpo_jax.plan` (__main__.py) is the CLI.

  targets.py   the accelerators compiled for without having them (deviceless), and their figures;
               `python -m grpo_jax.plan.targets` compiles the Pallas kernels for one
  programs.py  the run's programs (the K-steps jit, or the sampler and the update) built and compiled
  traffic.py   the collectives in a compiled program's HLO, per program and per decode step
  report.py    per-device memory, whether the step fits, a roofline estimate of its time
  advice.py    the knobs that lower memory without changing what is learned, each compiled again

Importing this package imports no jax: targets.py must be importable before jax starts.
"""
