"""Moving token copies to the ranks holding their experts and back: permutation, allgather, all-to-all, DeepEP."""
