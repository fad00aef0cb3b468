"""Optuna sweeps through Hydra: the search space from overrides (space.py), studies, samplers,
pruners and the trial lock (optuna_study.py: Optuna's study, not an ablation study), the sweeper (sweeper.py, registered as
`hydra/sweeper=optuna` by hydra_plugins/dalle_ablate_sweeper) and the job's side of a trial
(trial.py)."""
