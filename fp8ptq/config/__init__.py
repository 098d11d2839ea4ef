"""What a run should do, as data: the recipe (flags, schemes, recipe files) and the one plan built
from it."""
