"""The Ray runtime: worker actors, the coordinator, the router and the PDPipeline API."""
