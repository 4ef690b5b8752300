"""The ``synthetic`` workflow: reasoning data from a teacher, verified, deduplicated, filtered by
the student's pass rate, versioned, and used to fine-tune the student."""
