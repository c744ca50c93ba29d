"""Building blocks of the pipeline: config, store, tables, models, the rollout engine, the LM head,
selection, planning, identity. They never import a stage, the driver, the Session or a tool
(docs/architecture.md)."""
