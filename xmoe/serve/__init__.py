"""`xmoe serve`: the launcher around vLLM's OpenAI server (options, launch, server, auth), the demo model
(source, upcycle, template, demo) and a load runner (load)."""
