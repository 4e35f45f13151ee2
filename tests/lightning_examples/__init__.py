"""Lightning's own examples, as they are in its repository (Lightning-AI/pytorch-lightning
at 7f0c3436, ``examples/pytorch/``), unchanged: what our users' modules look like. The tests
replace their data and leave out what needs packages ringflow does not install."""
