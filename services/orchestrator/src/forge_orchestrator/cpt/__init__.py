"""Continual pre-training: the ``cpt`` workflow (mixture search as sweeps, final run, checkpoint
selection by a rule, hand-over to eval-and-promote) and its report activity."""
