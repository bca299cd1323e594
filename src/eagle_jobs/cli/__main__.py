"""`python -m eagle_jobs.cli`: what the `eagle-jobs` console script runs."""

from eagle_jobs.cli import main

main()
