"""How many tokens a prompt costs the engine: bounds first, the tokenizer when it matters."""
