# bench/openresty-group.gp: bench/openresty-group.png from the medians
# bench/openresty.lua measured.  Called as
#   gnuplot -e "data='<file>'; out='<png>'; n=<blocks>" bench/openresty-group.gp
# <file>: n blocks, two blank lines apart, each a quoted title line then
# lines "<connections> <requests/s>".
set terminal pngcairo size 1100,650 font ",10"
set output out
set title "OpenResty transfers: requests/s by wrk connections, grouped vs ungrouped (median of runs; log scales)"
set ylabel "requests/s"
set xlabel "wrk connections"
set logscale xy
set xtics (1, 16, 64)
set grid ytics mytics
set key outside right top noenhanced
plot for [i=0:n-1] data index i using 1:2 with linespoints lw 2 pt 7 ps 1.1 title columnheader(1)
