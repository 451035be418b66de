"""The fixed prompt set for greedy-reproduction checks (engine smoke and fidelity).

Twelve user turns of different kinds (facts, code, arithmetic, lists, prose), applied through
each model's own chat template.
"""

GREEDY_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List three primary colors.",
    "What is 17 multiplied by 23?",
    "Translate 'good morning' into Spanish.",
    "Give me a short poem about the sea.",
    "What does CPU stand for?",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "Name the largest planet in the solar system.",
    "How do I reverse a list in Python?",
    "What is the boiling point of water at sea level in Celsius?",
)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two greedy outputs differ; None when they are equal.
    One output ending earlier than the other is a divergence at its length."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
