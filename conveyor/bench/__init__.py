"""`conveyor bench`: an HTTP load generator for OpenAI-compatible servers, modelled on `vllm bench serve`."""
