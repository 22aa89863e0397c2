"""The caller's process (a driver's ``PDPipeline``, or a Serve ingress replica): the pipeline, its
request flows, router, output streams and detokenizer. It never imports the worker's code."""
