"""Synthetic reasoning data: generate, verify, deduplicate and decontaminate, filter by
difficulty, write the data set (issue 28, part 2).

API (the synthetic-data workflow builds on these; each module's docstring has the details):

- ``problems``: ``Problem`` / ``Solution`` (frozen dataclasses, ``to_json``/``from_json``,
  ``dumps``/``loads`` as JSON lines); ``Template`` (``id``, ``topic``, ``split`` train|held_out,
  ``description``) in ``TEMPLATES``, ``TRAIN_TEMPLATES``, ``HELD_OUT_TEMPLATES``; the ``Teacher``
  protocol (``write(template, index, k) -> Problem``, raising ``TeacherError`` on unusable
  output) and ``ProgrammaticTeacher(seed, error_rate, error_kinds, pot_rate)``, a program that
  writes problems and worked solutions with planted errors (not a model); ``generate(teacher,
  templates, count, k, retries=)`` -> ``GenerationReport`` (problems, failures counted by reason).
- ``verify``: ``Verifier(policy="drop"|"majority")``, ``.verify(problems)`` -> ``VerifyReport``
  (``kept``: ``Verified`` with the agreed ``answer``; ``dropped``: ``Dropped`` with ``reason``;
  ``counts()``); programs-of-thought run in ``forge_kit.sandbox``; ``parse_answer``,
  ``numbers_match``, ``grade(completion, answer)``.
- ``dedup``: MinHash LSH (``datasketch``) within the set and against the eval benchmarks' test
  splits (the eval tasks' folder: ``default_tasks_dir``), with counts per source.
- ``difficulty``: the ``Student`` protocol (``sample(prompts, n) -> completions``), pass rates, the
  band filter and its histogram (``EmptyBandError``); torch-free.
- ``student``: ``HFStudent``, the local student (torch) on a Forge export or any causal LM.
- ``dataset``: token shards, the SFT ``.jsonl`` the ``sft`` task reads, content hash, lineage.
- ``job``: the workflow's stage jobs (``python -m forge_training.synthetic.job STAGE --work DIR``:
  curate, band, held-out eval) over one run folder.
- ``teacher``: the programmatic teacher served over the OpenAI chat API (``python -m
  forge_training.synthetic.teacher --port N``), what the workflow calls when no model teaches.
"""
