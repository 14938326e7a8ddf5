"""The router: places each request on a prefill and a decode worker by prefix affinity, load and
its SLO, through filters, candidates with predictions, scorers and a picker (``router/router.py``)."""
