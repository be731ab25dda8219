"""The server's routes, one module per family, each an ``APIRouter`` named ``router``.

``completions`` (``POST /v1/completions``), ``chat`` (``POST /v1/chat/completions``), ``models``
(``GET /v1/models``, ``POST /tokenize`` and ``/detokenize``, ``GET /version`` and ``/health``),
``metrics`` (``GET /metrics``) and ``live`` (``GET /state`` and the page at ``/``). A route
receives what it needs through ``Depends`` (``get_serving``, ``get_engine_client`` of
``minipaged.serving.openai_serving``). The route functions carry no docstring: FastAPI would
publish it in ``/openapi.json``.
"""
