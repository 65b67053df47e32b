"""The replay benchmark: drafters compared on recorded rollouts (``ngramrl bench``)."""
