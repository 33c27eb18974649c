"""Client-side probes against any OpenAI-compatible server (xmoe, vLLM, llama.cpp, TabbyAPI): speed, needle,
tool calls, GSM8K, HumanEval, a sustained agentic replay; and the offline quality eval (KL, perplexity)."""
