"""``GET /metrics``: Prometheus' text format (``minipaged.serving.metrics``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from minipaged.serving.engine_client import EngineClient
from minipaged.serving.metrics import CONTENT_TYPE
from minipaged.serving.openai_serving import get_engine_client

router = APIRouter()


@router.get("/metrics")
async def metrics(client: Annotated[EngineClient, Depends(get_engine_client)]):
    def scrape():  # in a worker thread: the engine's values are read under its lock
        return client.metrics.exposition(client.stats())

    return Response(await run_in_threadpool(scrape), media_type=CONTENT_TYPE)
