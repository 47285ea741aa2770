# bench/scale.gp: bench/scale.png from what bench/scale.lua measured.
# Called as
#   gnuplot -e "data='<file>'; out='<png>'; modes='<m1> <m2> ...'" bench/scale.gp
# <file>: one line per run: mode, backlog, transactions/s, peak RSS (MiB).
set terminal pngcairo size 1200,500 font ",10"
set output out
set multiplot layout 1,2 title "mongotx recovery against the backlog (log scales)"
set logscale xy
set grid xtics ytics mxtics mytics
set key bottom left noenhanced
set xlabel "stale transactions (backlog)"
set ylabel "transactions/s"
set title "rate"
plot for [m in modes] sprintf("< grep '^%s ' %s", m, data) using 2:3 with linespoints lw 2 pt 7 title m
set ylabel "peak RSS of the recovering process (MiB)"
set title "memory"
set yrange [1:1000]
plot for [m in modes] sprintf("< grep '^%s ' %s", m, data) using 2:4 with linespoints lw 2 pt 7 title m
unset multiplot
