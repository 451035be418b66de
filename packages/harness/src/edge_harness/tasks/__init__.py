"""Task-level quality: HumanEval pass@1 of each build, served as a user would serve it, with the
model-written code run only in our sandbox (`sandbox.py`)."""
