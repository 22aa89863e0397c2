"""The caller's process (a driver's ``PDPipeline``, or a Serve ingress replica): the pipeline, its
request flows (``flows``), router, output streams (``streams``), detokenizer (``detok``), the one
check of a request against the model (``validate``), the results it hands back (``results``) and
the private event loop behind the blocking API (``bgloop``). It never imports the worker's code."""
