"""Text that prompts are made of: the haystack essays and their splits, and prompts built to
a token length."""
