"""Serve a model checkpoint, or a registry's production version, over HTTP with Ray Serve.

:func:`serve_model` deploys one Serve application for one checkpoint on an already
initialised Ray; :func:`serve_registry` deploys one that serves whatever the registry's
production pointer names and follows it: each replica polls the pointer (every ``poll_s``),
loads and self-checks a new version in a background thread, then swaps one reference, so
no request fails or mixes models during the switch. A :class:`ModelServer` replica answers
``POST /predict``, ``GET /healthz`` and ``GET /model`` behind a FastAPI ingress. The Serve
controller is detached, so an application deployed on a long-running Ray head keeps
serving after the caller's process exits; :func:`shutdown_serving` deletes it.

Deploying again what already runs (the same source, options, token, name, route and code:
one digest, which every replica reports in ``GET /healthz``'s ``X-Ringflow-Deployment``
header) does not redeploy. For a registry the running replicas are already following the
pointer, so the caller only waits until they serve the production version. Anything else
is a Serve rolling update.

The package is generic over the served model. The request follows the data the model was
trained on: the engine records the dataset's schema in every checkpoint
(``meta["data_schema"]``), and the server takes one input as an object of the named features,
``{"x1": 0.3, "color": "red"}`` (a category as its string), or several as
``{"instances": [...]}``, each an object of features or an array in schema order. A module
that declares an ``input_schema`` class attribute (the digits demo: ``{"name": "pixels",
"shape": [64], ...}``) is sent that named array instead. The answer follows the module:
its own ``predict_step``'s output under ``prediction``; else, for classification, the class
(its category string for a category label) under ``label`` (or the module's
``output_name``) and the softmax ``probabilities``; for regression, ``value``. Every bad
request gets a 4xx with a JSON ``{"error": "..."}`` naming what is wrong; the replica never
dies of one.

Its rooms: :mod:`.schema` (what a request holds and an answer says), :mod:`.replica` (one
Serve replica), :mod:`.deployment` (deploying, redeploying and stopping).
"""

from ringflow.serving.deployment import serve_model, serve_registry, shutdown_serving
from ringflow.serving.replica import ModelServer
from ringflow.serving.schema import ServingError

__all__ = ["ModelServer", "ServingError", "serve_model", "serve_registry", "shutdown_serving"]
