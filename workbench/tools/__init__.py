"""What plugins use: the sandbox that runs model-written Python and the graders of answers. A
plugin's helpers change here; the audit path never imports them."""
