"""The RLHF loop: the ``rlhf`` workflow (online rounds of rated samples, reward-model retraining
and DPO), its input, records and rules, its activities, the ``rlhf_job`` child and its worker."""
