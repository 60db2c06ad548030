"""dhp: disaggregated hybrid parallelism for multimodal training."""
