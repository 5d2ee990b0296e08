"""sdfarm.scheduler: registry, placement, dispatch, the client (`Farm`) and the `sdfarm` CLI."""
