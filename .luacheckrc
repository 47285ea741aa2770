std = "max"
max_line_length = 120
files["spec/**"] = { std = "+busted" }
globals = { "jit" }
