"""Stage 3, train: the EAGLE-3 draft, with speculators 0.9.0's model, Trainer and data code.

The modules, each one job:

- `run`: the stage's entry, `run_train`, read top to bottom (check the extraction, resolve the draft
  shape, vocab mapping, data, model, resume, train, export), and the train_config.json record;
- `launch`: a world size above one as torchrun's ranks in child processes, and their exit codes;
- `checkpoints`: checkpoints in the store (commit, restore, prune) and the epoch final/ exports;
- `data`: the vocab mapping's token counts, shards staged to local disk, the datasets and loaders
  (train.source stream: training's side of the stream is eagle_jobs.stream.feed).

No re-exports: each name is imported from the module that defines it.
"""
