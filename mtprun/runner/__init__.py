"""The runner: a recipe run on Ray. Its rooms (tests/test_layers.py keeps their order):

    run/       the top: the driver, its stages and steps, checkpoints, export, evaluation;
               it composes the rooms below.
    trainer/   the Megatron-core policy and its optimizer, one Ray actor per rank.
    rollout/   the vLLM engines, episodes and rewards.
    tracking/  the MLflow writer and its spool.
    *.py       what the rooms share: the run folder (run_dir), the checkpoint policy folders
               (policy_folder), placement, actors, ports (net), weight transfer, CUDA IPC.

trainer, rollout and tracking import only the shared modules, never each other or run.
"""
