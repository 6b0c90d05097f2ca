"""Training: state, the pure step, the loop, checkpoints and logs, shared by pretraining and fine-tuning."""
