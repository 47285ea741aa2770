-- An LDoc filter for spec/support/check-docs.lua: prints "module<TAB>item"
-- for every documented item (ldoc --filter ldoc_names.dump .).
return { dump = function(modules)
  for _, m in ipairs(modules) do
    for item in m.items:iter() do print(m.name, item.name, item.type) end
  end
end }
