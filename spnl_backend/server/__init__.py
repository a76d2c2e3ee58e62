"""The OpenAI-compatible HTTP server (``spnl-backend serve``) over one backend's engine
loop: `create_app` builds the Starlette app, `serve` runs it with uvicorn."""
