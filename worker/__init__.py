"""sdfarm.worker: Celery workers that hold loaded engines, one process per device."""
