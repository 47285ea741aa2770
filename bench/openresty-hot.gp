# bench/openresty-hot.gp: bench/openresty-hot.png from the hot-account
# medians bench/openresty.lua measured.  Called as
#   gnuplot -e "data='<file>'; out='<png>'; hot=<accounts>; cold=<accounts>" bench/openresty-hot.gp
# <file>: one line per cell, "<label> <requests/s on hot> <requests/s on cold>".
set terminal pngcairo size 900,500 font ",10"
set output out
set title sprintf("Guarded transfers in nginx (2 workers): %d hot accounts against %d (median of runs)", hot, cold)
set ylabel "requests/s"
set yrange [0:*]
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 border -1
set grid ytics
set key top left noenhanced
plot data using 2:xtic(1) title sprintf("%d accounts", hot), '' using 3 title sprintf("%d accounts", cold)
