"""eagle-jobs: EAGLE-3 draft training for very large verifiers, as batch stages
that hand bf16 tensors and checkpoints to each other through object storage."""

__version__ = "0.1.0"
