"""A plain transformers baseline server: OpenAI-compatible /v1/completions, ONE request at a time.

Each request runs `model.generate` (greedy) on a worker thread with a per-token streamer; requests that
arrive meanwhile wait on a lock, FIFO. No batching at all: this is what serving with `generate` looks like
without a scheduler. Loopback only.

    .venv/bin/python -m benchmarks.hf_server --model smollm2 --port 8100
"""
from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from transformers.generation.streamers import BaseStreamer


class CompletionBody(BaseModel):
    model: str | None = None
    prompt: str | list[int]
    max_tokens: int = 16
    stream: bool = False
    temperature: float = 0.0  # accepted, ignored: the baseline decodes greedily
    ignore_eos: bool = False
    stream_options: dict | None = None


class _TokenStreamer(BaseStreamer):
    """Hands each generated token id to an asyncio queue (the first put is the prompt: skipped)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue, self.seen_prompt = loop, queue, False

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        for tid in value.reshape(-1).tolist():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, int(tid))

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


def create_app(model_path: str, model_name: str = "smollm2", threads: int | None = None) -> FastAPI:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    lock = asyncio.Lock()
    app = FastAPI()

    def generate(ids: list[int], body: CompletionBody, streamer: _TokenStreamer) -> None:
        try:
            with torch.inference_mode():
                model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=body.max_tokens, do_sample=False, streamer=streamer,
                               min_new_tokens=body.max_tokens if body.ignore_eos else None,
                               pad_token_id=tokenizer.eos_token_id)
        finally:
            streamer.end()  # generate() already calls it; a second None is harmless, a missing one hangs

    async def tokens(body: CompletionBody) -> AsyncIterator[int]:
        ids = body.prompt if isinstance(body.prompt, list) else tokenizer.encode(body.prompt)
        async with lock:  # one generate at a time: the baseline has no batching
            queue: asyncio.Queue = asyncio.Queue()
            streamer = _TokenStreamer(asyncio.get_running_loop(), queue)
            worker = threading.Thread(target=generate, args=(ids, body, streamer), daemon=True)
            worker.start()
            while (tid := await queue.get()) is not None:
                yield tid
            await asyncio.to_thread(worker.join)

    def chunk(rid: str, text: str, finish: str | None, usage: dict | None = None) -> str:
        msg = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
               "choices": [] if usage else [{"index": 0, "text": text, "finish_reason": finish}]}
        if usage:
            msg["usage"] = usage
        return f"data: {json.dumps(msg)}\n\n"

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):  # noqa: ANN202 - a JSON or an SSE response
        rid = f"cmpl-{uuid.uuid4().hex[:12]}"
        if isinstance(body.prompt, list) and any(not 0 <= t < model.config.vocab_size for t in body.prompt):
            return JSONResponse({"error": {"message": "prompt token id out of range"}}, status_code=400)
        n_prompt = len(body.prompt) if isinstance(body.prompt, list) else len(tokenizer.encode(body.prompt))
        if not body.stream:
            ids = [t async for t in tokens(body)]
            usage = {"prompt_tokens": n_prompt, "completion_tokens": len(ids),
                     "total_tokens": n_prompt + len(ids)}
            return JSONResponse({"id": rid, "object": "text_completion", "model": model_name, "usage": usage,
                                 "choices": [{"index": 0, "text": tokenizer.decode(ids),
                                              "finish_reason": "length"}]})

        async def sse() -> AsyncIterator[str]:
            n = 0
            async for tid in tokens(body):
                n += 1
                # one chunk per token; an undecodable partial byte still marks a token's arrival
                yield chunk(rid, tokenizer.decode([tid]) or "\ufffd", None)
            yield chunk(rid, "", "length")
            if body.stream_options and body.stream_options.get("include_usage"):
                yield chunk(rid, "", None, {"prompt_tokens": n_prompt, "completion_tokens": n,
                                            "total_tokens": n_prompt + n})
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a local HF model dir")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    import uvicorn

    from conveyor.serving.models.loader import resolve_model_path

    path = str(resolve_model_path(args.model)) if args.model == "smollm2" else args.model
    uvicorn.run(create_app(path, args.model, args.threads), host="127.0.0.1", port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
