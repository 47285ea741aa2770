-- An LDoc filter for spec/support/check-docs.lua: prints
-- "module<TAB>item<TAB>type<TAB>summary" for every documented item
-- (ldoc --filter ldoc_names.dump .).
return { dump = function(modules)
  for _, m in ipairs(modules) do
    for item in m.items:iter() do
      print(m.name, item.name, item.type, ((item.summary or ""):gsub("%s+", " ")))
    end
  end
end }
