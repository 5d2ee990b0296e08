"""sdfarm.scheduler: the scheduler service: registry, placement, fairness, dispatch, leader."""
