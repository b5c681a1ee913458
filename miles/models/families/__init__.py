"""One module per model family; `miles.models.registry` maps names to them."""
