"""Training runs: the ``training`` workflow (one job through the scheduler and the trainer
agents), its input, result and checkpoint signal, and the API's check of its input."""
