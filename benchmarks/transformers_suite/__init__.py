"""transformers' own model test files run with hf_memo applied, and the stock-vs-hf_memo comparison."""
