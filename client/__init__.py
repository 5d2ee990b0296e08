"""sdfarm.client: the Python SDK of a farm (`Farm`, `Job`, `Result`) and the batch runner.

A client talks to the farm's Redis only, through `sdfarm.store`; it never needs the scheduler
to answer it.
"""
