std = "max"
max_line_length = 100
files["spec/**"] = { std = "+busted" }
globals = { "jit" }
