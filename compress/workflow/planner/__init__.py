"""`layercut plan`: the best depth cut x bits for a size target (space, predictions, search, report)."""
