"""`llmstep serve`: the continuous batcher over the paged KV cache behind an OpenAI-compatible HTTP server.

    protocol.py   the OpenAI API's request bodies checked field by field, its response bodies and errors
    engine.py     the engine thread: a PagedSession stepped in a loop, requests in, tokens out, backpressure
    app.py        the routes (FastAPI on uvicorn), server-sent events, disconnects, the signals
    loadgen.py    the load generator: Poisson arrivals, throughput, TTFT and inter-token latency percentiles

Needs the `serve` extra (`pip install -e .[serve]`): fastapi and uvicorn; the load generator uses httpx.
"""
