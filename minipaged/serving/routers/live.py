"""``GET /state`` (the engine's queues and block map as JSON) and ``GET /``, the live page that draws it."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import HTMLResponse
from starlette.concurrency import run_in_threadpool

from minipaged.serving import live_page
from minipaged.serving.engine_client import EngineClient
from minipaged.serving.openai_serving import get_engine_client

router = APIRouter()


@router.get("/state")
async def state(client: Annotated[EngineClient, Depends(get_engine_client)]):
    return await run_in_threadpool(client.snapshot)  # in a worker thread: it takes the engine's lock


@router.get("/", response_class=HTMLResponse)
async def page():
    return live_page.PAGE
