"""``python -m dsv4c.runtime.tensor_parallel ARTIFACT --rank R ...``: a rank RankGroup starts."""

from dsv4c.runtime.tensor_parallel.rank_loop import main

main()
