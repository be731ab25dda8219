"""The learner's and the teacher's tools: exercises, grading, the mutant catalogue, ``show``, pictures."""
